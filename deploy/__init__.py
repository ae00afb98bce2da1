"""The Ray Serve application: Router ingress (handle + HTTP) in front of EngineReplica deployments.

Public names (imported from their modules; importing this package imports nothing):

    from deploy.app import build_app, run            # build_app(args: AppArgs | dict) -> Application
    from deploy.config import AppArgs                # the args of serve_config.yaml, documented per field
    from deploy.router import Router                 # handle methods: generate, capture, capture_batch, info, stats, ready
    from deploy.balance import CostAwareRequestRouter, CostLedger   # least-outstanding-cost routing
    from deploy.readiness import ReadyStatus         # Router.ready() and GET /readyz
    from deploy.http import api                      # HTTP: native routes and the OpenAI-compatible ones (deploy.openai_routes)

See docs/serving.md and docs/openai.md.
"""
