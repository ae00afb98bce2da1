"""Read-outs computed on the replica's device (logit lens, tuned lens, linear probes): their
engine options, catalog and host buffers, checked outside the device (`specs`), and their
weights and compute on the device (`device`). docs/readouts.md."""
