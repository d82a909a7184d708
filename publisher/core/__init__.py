"""The pure core: the TrafficMap as read (model), exact quantities, recomputed weights, the gates,
verification and the plan of what a gateway should hold.

Owns no state and does no I/O (no asyncio, HTTP, Kubernetes, logging or metrics); it may import only
itself. Every other stage imports it. import-linter's "pure-core" contract holds this.
"""
