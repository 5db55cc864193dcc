"""Reports over the engines (the benchmarks are :mod:`tracefp4.bench`); the package CLI imports these, never the other
way round. What they measure with (arms run through the store, the log-prob gap, code-mismatch totals, the
store's byte accounting) is :mod:`tracefp4.pipeline.measure`.

* :mod:`~tracefp4.reports.mismatch`: ``tracefp4 mismatch``, trainer vs rollout per arm;
* :mod:`~tracefp4.reports.sweep`: ``tracefp4 mismatch --sweep``, guidance bytes vs agreement per mode;
* :mod:`~tracefp4.reports.commands`: the ``mismatch`` command, joining the two;
* :mod:`~tracefp4.reports.capacity`: ``tracefp4 plan``, guidance volume per RL step from a model config;
* :mod:`~tracefp4.reports.twopath`: ``tracefp4 twopath``, the model-free two-engine demonstration;
* :mod:`~tracefp4.reports.publish`: how each report command prints its report and writes ``--json`` / ``--plot``.
"""
