"""pipeline: what every consumer of the engines shares, between ``engines`` and ``rl``.

* :mod:`~tracefp4.pipeline.arms`: the arm table (plan, guidance, diagnostics, trainer, loss, label,
  style, role) and the reports' views of it as queries;
* :mod:`~tracefp4.pipeline.factory`: :class:`EngineKind` and :func:`make_engine`, the one place an
  engine is built, and :func:`supports`;
* :mod:`~tracefp4.pipeline.steps`: the rollout of one store step, the trainer's spec, weight sync;
* :mod:`~tracefp4.pipeline.measure`: arms run over one model and prompts, as every report measures;
* :mod:`~tracefp4.pipeline.metrics`: the metrics registry and its summary functions.
It imports ``engines``, ``guidance`` and ``formats``; ``rl``, ``reports``, ``integrations`` and the
command line import it, and it never imports them.
"""
