"""Chapter 3 — canonical results (declared now so the layer contract covers it; built in
issue 4): one result format for every worker, order-restoring merge, exact metric reduction
and the worker timeline. May import avrid.dispatch and avrid.workers."""
