"""Runtime: latency tables, the SLO chunk scheduler and the serving engine.

Not built yet (later issues). The phase-dispatch crossover is a config value
(``CompileConfig.crossover_m``) until measured latency tables land here.
"""
