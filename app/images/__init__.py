"""Image checks and preparation, run in the CPU lane.

Its face, what the other packages import (tests/test_layers.py holds them to it):
`prepare` (`prepare_image`, `PreparedImage`, `NotInline`: intake, scans, stages), `limits`
(`ImageLimits`: intake) and `data_url` (intake). The other modules are the steps of a
preparation, this package's own.
"""

__all__ = ["data_url", "limits", "prepare"]
