"""Plain data shared by every layer: sampling parameters, requests, forward batches (the
one module here that needs torch: `core.batch`; the others load in the HTTP process too)."""
