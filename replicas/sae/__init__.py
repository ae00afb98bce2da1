"""SAEs served on the replica: their specs and catalog, checked outside the device (`specs`), and
their weights and encode on the device (`device`)."""
