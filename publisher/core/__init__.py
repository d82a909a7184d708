"""The pure core: the input's shape and our own values, exact quantities, recomputed weights, the
gates, verification and the plan of what a gateway should hold.

The modules, in the order a map meets them: model (the TrafficMap and InferenceService as read),
values (MapKey, Reason, Held, Backend, Route, Publication, the condition of each region), addresses
(endpoints, hostnames, DNS names, HOST:PORT), durations (the one duration grammar, DurationRange),
quantity, weights, gate, verify, plan.

Owns no state and does no I/O (no asyncio, HTTP, Kubernetes, logging or metrics); it may import only
itself, pydantic and the standard library. Every other stage imports it. import-linter's
"pure-core" contract holds this, and tests/test_layering.py that the leaves (model, values,
addresses, durations, quantity) import no other stage of the core.
"""
