"""What one request wants from the worker: the engine validates a request into a wire plan, the
worker reads it back each step (`request`), with the per-head parts in `heads` and the rows a
position spec selects in `positions`."""
