"""In-place recovery's store protocol: agreeing on who goes on after a failure (shrink)
and whom to admit (grow). The API that rebuilds the world on it: ``api.recovery``."""
