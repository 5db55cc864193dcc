"""The model's two FP4 paths and the engines that run them: the rollout's and the QAT trainer's.

Holds the precision plan (:mod:`~.plan`: which tensors are FP4 or FP8, with which quantizer), the
Hugging Face model's seams (:mod:`~.model`, :mod:`~.sites`, :mod:`~.experts`, :mod:`~.kvcache`),
the rollout engines behind one protocol (:mod:`~.protocol`: our :mod:`~.rollout` engine,
:mod:`~.vllm`'s), the records a rollout captures (:mod:`~.capture`, :mod:`~.sink`) and the
trainer's guided forward (:mod:`~.trainer`, :mod:`~.guidance`, rows mapped by :mod:`~.rows`).
Entry points: ``model.prepare_model``, ``plan.PrecisionPlan``, ``trainer.trainer_forward`` (engines
are built by ``pipeline.factory.make_engine``). Imports ``formats`` (the numerics and kernels), ``guidance`` (what a
rollout records) and ``faults``; imported by ``pipeline``, ``rl``, ``reports``, ``integrations``, ``bench``, ``cli``.
"""
