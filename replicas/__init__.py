"""The instrumented vLLM engine and the replica deployment that owns it (one GPU each).

Packages, by the process their code runs in:
- `api/`: the request contract (schemas, hook names, errors, the array format), torch-free; the
  router and the provider import only this.
- `engine/`: the replica's side of vLLM (`CaptureEngine`, `EngineConfig`, architectures).
- `worker/`: code inside vLLM's worker process (hook sites, step tables, row collection).
- `plans/`: a request turned into what the worker reads each step (built by the engine).
- `arena/`: host shared memory between the worker and the replica, and its lifeline.
- `sae/`, `readouts/`, `shards/`: SAE features; logit/tuned lens and probe read-outs; capture shards and
  the replica-side sink.
- `replica.py` (the Serve deployment), `_vllm/` (the one package that touches vLLM internals),
  `tiny.py` (tiny random test models).

Public names: `replicas.api` (request/response schemas, `resolve_hook`), `replicas.engine.CaptureEngine`
and `EngineConfig`, `replicas.tiny.make_tiny_model`, `replicas.replica.EngineReplica` and
`replicas.api.errors`. Importing this package imports neither torch nor vLLM.
"""
