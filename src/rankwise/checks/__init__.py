"""Checks: call identity, who-is-where reports and their formatting.

The layer under the communicator and the engines (docs/design.md, "Layers": API -> checks ->
algorithms -> transport): these modules import only the bottom (wire, buffers, call
sites, errors), never the API, so everything above can import them at the top.
"""
