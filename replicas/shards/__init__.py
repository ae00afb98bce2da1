"""Capture shards on disk or any fsspec store: the files format (`files`), where they live
(`store`), and the replica-side sink that writes a batch of input lines into one shard (`sink`)."""
