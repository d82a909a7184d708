"""The split check: does each gateway instance split requests as the published weights say?

`stats` is pure statistics over counted requests (part of the pure core); `check` owns the count
windows and the verdicts, fed by the adapters' request counters, and may import the core and
`adapters.base` only.
"""
