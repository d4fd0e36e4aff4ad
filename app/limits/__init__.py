"""Clock, retry policy, stage gates, rate budgets (local and shared), admission, the CPU
lane, the sizing of every `auto` limit.

Its face, what the other packages import (tests/test_layers.py holds them to it): intake
admits through `admission`, `loop_pacer`, `cpu_lane` and `user_quota`; the scans and
stages hold a `Ticket` (`admission`) and read the `clock` and `timeouts`; upstream reserves
from `rate_budget` behind `stage_gate` and `route_limits`, with `retry` and
`late_timeouts`; settings parse `sizing` and `charge_learning`. The rest (the shared
budget and caps, adaptive limits, the loop's capacity, rate headers and learning) is this
package's own or built by the lifespan (app/resources.py), which may import any module.
"""

__all__ = [
    "admission",
    "charge_learning",
    "clock",
    "cpu_lane",
    "late_timeouts",
    "loop_pacer",
    "rate_budget",
    "retry",
    "route_limits",
    "sizing",
    "stage_gate",
    "timeouts",
    "user_quota",
]
