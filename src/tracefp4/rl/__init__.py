"""GRPO over the engines: the arms (BF16, vanilla FP4 QAT, TRACE, the baselines) side by side.

Holds the run (:mod:`~.config`, :mod:`~.loop`: warm start, then each arm's steps), one step's
experience (:mod:`~.collect`, through ``pipeline.steps`` and the guidance store) and update
(:mod:`~.update`, :mod:`~.grpo`, :mod:`~.score_centering`, :mod:`~.optim`, :mod:`~.distributed`),
tasks and evaluation (the arm table is ``pipeline.arms``), and the run folder (:mod:`~.runfolder`,
:mod:`~.runlog`, :mod:`~.checkpoint`, :mod:`~.report`); :mod:`~.experiment` runs a config over seeds.
Entry points: ``config.RLConfig``, ``loop.run``, ``experiment.run_experiment``. Imports ``pipeline``,
``engines``, ``guidance``, ``formats`` and the shared helpers (``files``, ``seeds``, ``provenance``,
``faults``); imported by ``cli``, ``reports``, ``integrations`` and ``gendocs``; never by ``pipeline``.
"""
