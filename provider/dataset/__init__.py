"""The dataset pipeline behind `capserve capture` and `capserve export`: input files, the
harvester, the shard format and `load_capture`, the manifest, the backends, SAELens export.

    from provider.dataset.shards import load_capture   # also provider.load_capture
"""
