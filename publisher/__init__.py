"""ome-gateway-publisher: puts OME TrafficMap weights into a global gateway."""

__version__ = "0.1.0"
