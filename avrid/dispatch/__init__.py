"""Chapter 2 — token-aware dispatch (declared now so the layer contract covers it; built in
issue 3): the atomic unit of dispatch, cost models, balanced partitioning across DP shards,
token-budget micro-batches and an invertible dispatch plan. May import avrid.workers only."""
