"""The Envoy adapter: its options and `build`, for the registry (adapters.ADAPTERS).

- options.py: EnvoyOptions, both modes'.
- render.py: file mode's renderer and read-back (pure); files.py: the transport writing the
  directory Envoy watches; admin.py: the admin API client it confirms writes with.
- bootstrap.py: both modes' Envoy bootstraps (pure); process.py: a real Envoy for the tests and the demo.
- xds.py: xDS mode's server; xds_plan.py: each Envoy session's plan (pure); resources.py: the
  xDS resources (pure); lrs.py: Envoy's load reports; names.py: the cluster names all share.
"""

from __future__ import annotations

from typing import Any

from adapters.envoy.files import build_files
from adapters.envoy.options import EnvoyOptions

__all__ = ["EnvoyOptions", "build"]


def build(options: EnvoyOptions) -> tuple[Any, Any]:
    """The renderer and transport of the mode `options` choose: xDS server, or watched files."""
    if options.envoy_xds_listen is not None:
        # Imported only in xDS mode: file mode runs without grpcio and xds-protos.
        from adapters.envoy.resources import XdsRenderer
        from adapters.envoy.xds import XdsTransport

        renderer = XdsRenderer(
            ca_file=options.envoy_ca_file,
            rewrite_host=options.rewrite_host,
            timeout=options.route_timeout,
            idle_timeout=options.route_idle_timeout,
        )
        return renderer, XdsTransport(options.envoy_xds_listen, renderer, options.load_server_tls())
    return build_files(options)
