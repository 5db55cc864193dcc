"""tracefp4 inside other frameworks' trainers.

* :mod:`tracefp4.integrations.trl`: ``TraceGRPOTrainer`` / ``TraceGRPOConfig``, TRL's ``GRPOTrainer``
  with FP4 rollouts on our engines, records through the guidance store and the guided QAT forward.
* :mod:`tracefp4.integrations.trl_async`: ``TraceAsyncGRPOTrainer`` / ``TraceAsyncGRPOConfig``, TRL's
  asynchronous ``AsyncGRPOTrainer`` with rollouts on our engine in a thread, records read at each
  sample's own policy version and the decoupled (behaviour / proximal) loss.

Any other trainer uses the trainer-side API directly (:func:`tracefp4.engines.trainer.trainer_forward`,
see ``docs/integrations.md``). Each integration imports its framework only when it is imported.
"""
