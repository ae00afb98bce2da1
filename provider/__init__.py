"""The inspect_ai provider (`capserve/<model>`) and the Python client for the Serve app.

Public names:

    from provider import CaptureClient                      # sync + async client over the handle
    from provider import read_activations, read_logits      # arrays back from an inspect eval log
    from provider import activation_info                    # hooks, positions, replica of a call
    from provider import load_capture                       # shards written by `capserve capture`
    from provider.inspect_provider import CapserveAPI       # the ModelAPI (registered by entry point)
    from provider.tl_bridge import boot_bridge              # TransformerLens's bridge on the app (extra tl)

Importing this package imports neither Ray nor inspect_ai; each is imported when first needed.
"""

from provider.activations import activation_info, read_activations, read_logits
from provider.client import CaptureClient, load_capture

__all__ = ["CaptureClient", "activation_info", "load_capture", "read_activations", "read_logits"]
