"""GRPO over the engines: the arms (BF16, vanilla FP4 QAT, TRACE, the baselines) side by side.

Holds the run (:mod:`~.config`, :mod:`~.loop`: warm start, then each arm's steps), one step's
experience (:mod:`~.collect`, through :mod:`~.engine` and the guidance store) and update
(:mod:`~.update`, :mod:`~.grpo`, :mod:`~.score_centering`, :mod:`~.optim`, :mod:`~.distributed`),
the arm table (:mod:`~.arms`), tasks and evaluation, and the run folder (:mod:`~.runfolder`,
:mod:`~.runlog`, :mod:`~.checkpoint`, :mod:`~.report`); :mod:`~.experiment` runs a config over seeds.
Entry points: ``config.RLConfig``, ``loop.run``, ``experiment.run_experiment``. Imports ``engines``,
``guidance``, ``formats``, ``metrics`` and the shared helpers (``files``, ``seeds``, ``provenance``,
``faults``); imported by ``cli``, ``reports``, ``integrations``, ``gendocs`` and ``metrics``.
"""
