"""``tracefp4 bench``: the benchmarks, one package (modelled on vLLM's ``vllm/benchmarks/`` and torchao's shared timing helper).

* :mod:`~tracefp4.bench.harness`: how everything is timed: interleaved rounds, paired ratios, runs of steps, median and spread;
* :mod:`~tracefp4.bench.result`: the typed :class:`~tracefp4.bench.result.Record`, the versioned results file, one formatting;
* :mod:`~tracefp4.bench.targets`: the targets, read from ``targets.toml``, judged on a run;
* :mod:`~tracefp4.bench.memory`: the resident-memory probe and the fresh process it runs in (JSON in and out);
* :mod:`~tracefp4.bench.server`: a vLLM engine in a process of its own, one command set;
* :mod:`~tracefp4.bench.decode`: stepped decode and where its time goes, in our engine and in vLLM's;
* :mod:`~tracefp4.bench.suites`: numerics, system, attention, rollout, long: what each measures;
* :mod:`~tracefp4.bench.cli`: the subcommands, and ``bench all``, which runs every suite (``--size toy`` for a quick check).
Engines are built by :func:`tracefp4.pipeline.factory.make_engine` from their :class:`~tracefp4.pipeline.factory.EngineKind`.
"""
