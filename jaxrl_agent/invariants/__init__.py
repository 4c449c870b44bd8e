"""The three invariants agentic RL keeps in bounds: exploration does not collapse, the learning
signal does not degenerate, drift between sampling, training and deployment stays bounded.

  measures    pure estimators over an iteration's episodes (pass@k, distinct solutions, entropy,
              identical groups, outcome shares, gap and lag statistics)
  alarms      hysteresis state machines over the metrics (`AlarmSpec`, `AlarmState`, `step_all`)
  responses   the opt-in controller that moves run-time knobs while an alarm is on (`respond`)
  monitor     one iteration of both, as a pure step over the record (`monitor.step`)
"""

from jaxrl_agent.invariants import alarms, measures, monitor, responses
from jaxrl_agent.invariants.alarms import AlarmSpec, AlarmState
from jaxrl_agent.invariants.monitor import MonitorState, Settings
from jaxrl_agent.invariants.responses import Controls, ResponseBounds

__all__ = ["AlarmSpec", "AlarmState", "Controls", "MonitorState", "ResponseBounds", "Settings", "alarms", "measures",
           "monitor", "responses"]
