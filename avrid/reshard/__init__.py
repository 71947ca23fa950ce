"""Chapter 4 — resharding (declared now so the layer contract covers it; built in issue 5):
parameter layouts, a minimum-bytes transfer plan, its execution over torch.distributed and
loading into rollout engines. May import avrid.results, avrid.dispatch and avrid.workers."""
