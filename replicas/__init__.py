"""The instrumented vLLM engine and the replica deployment that owns it (one GPU each).

Public names: `replicas.api` (request/response schemas), `replicas.engine.CaptureEngine` and
`EngineConfig`, `replicas.tiny.make_tiny_model`, `replicas.hooks.resolve_hook`. Importing this
package imports neither torch nor vLLM.
"""
