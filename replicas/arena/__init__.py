"""Host shared memory between the engine's worker and the replica: the arena of capture rows
(`host`), the replica's client of it (`client`), and the lifeline that removes both an engine's
processes and its shared-memory folder when the replica that owns them is gone."""
