"""The instrumented vLLM engine and the replica deployment that owns it (one GPU each).

Public names: `replicas.api` (request/response schemas), `replicas.engine.CaptureEngine` and
`EngineConfig`, `replicas.tiny.make_tiny_model`, `replicas.hooks.resolve_hook`,
`replicas.replica.EngineReplica` (the Serve deployment class) and `replicas.errors`. Importing this
package imports neither torch nor vLLM.
"""
