"""The engine loop (EngineCore: schedule -> run -> sample -> postprocess) and what it keeps: the scheduler,
the KV block pool, the launched step, outputs, detokenizing, the engine-backend interface AsyncEngine
drives, and a running request taken out of one engine and put into another."""
