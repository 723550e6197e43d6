"""User-facing configuration: the server-wide KV policy, the server's settings and the per-request
override, all validated by pydantic models. One module per concern:

- `base.py`: what the models share: their trip through the environment, one error line;
- `budget.py`: how a budget is written (`parse_budget`, `spelling`, `parse_min_budget`);
- `policy.py`: the policy a request runs (`KvConfig`) and what a request may override (`OverridePolicy`);
- `recall.py`: the host tier's bounds and measured defaults, and recall's knobs (`RecallTuning`);
- `server.py`: the settings every process shares (`ServerSettings`), and the server as the launcher
  starts it (`Launch`), whose validators are the rules that relate two settings;
- `request.py`: a request's own config, judged by the operator's rules (`request_override`);
- `flags.py`: the launcher's flags and `sgl.Engine`'s keywords, made from the models' fields (`FLAGS`).

Server-wide settings travel from the launcher to SGLang's other processes in the environment
(`KVEVICT_SERVER_CONFIG`, `KVEVICT_SERVER_SETTINGS`). A request may override them with
`custom_params={"kvevict": {"policy": ..., "budget": ..., "config": {...}}}`.
"""

from sgl_kvevict.config.base import first_error
from sgl_kvevict.config.budget import (
    DEFAULT_BUDGET,
    MAX_BUDGET_TOKENS,
    parse_budget,
    parse_min_budget,
    spelling,
)
from sgl_kvevict.config.flags import FLAG, FLAGS, Flag, interval
from sgl_kvevict.config.policy import ENV_VAR, MAX_CAPTURE, KvConfig, OverridePolicy, server_config
from sgl_kvevict.config.recall import (
    DEFAULT_RECALL_EVERY,
    DEFAULT_RECALL_PAGE,
    HOST_POOL_RATIO,
    HOST_RAM_SHARE,
    MAX_HOST_GIB,
    MAX_HOST_TOKENS,
    MAX_RECALL_EVERY,
    MAX_RECALL_PAGE,
    MAX_RECALL_TOKENS,
    MIN_HOST_GIB,
    RecallTuning,
)
from sgl_kvevict.config.request import REQUEST_KEY, request_override
from sgl_kvevict.config.server import (
    DEFAULT_CAPTURE_SLOTS,
    MAX_STEP_TOKENS,
    SETTINGS_ENV_VAR,
    Launch,
    ServerSettings,
    capture_needed,
    server_settings,
)

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_CAPTURE_SLOTS",
    "HOST_POOL_RATIO",
    "HOST_RAM_SHARE",
    "DEFAULT_RECALL_EVERY",
    "DEFAULT_RECALL_PAGE",
    "ENV_VAR",
    "FLAG",
    "FLAGS",
    "MAX_BUDGET_TOKENS",
    "MAX_CAPTURE",
    "MAX_HOST_GIB",
    "MAX_HOST_TOKENS",
    "MAX_RECALL_EVERY",
    "MAX_RECALL_PAGE",
    "MAX_RECALL_TOKENS",
    "MAX_STEP_TOKENS",
    "MIN_HOST_GIB",
    "REQUEST_KEY",
    "SETTINGS_ENV_VAR",
    "Flag",
    "KvConfig",
    "Launch",
    "OverridePolicy",
    "RecallTuning",
    "ServerSettings",
    "capture_needed",
    "first_error",
    "interval",
    "parse_budget",
    "parse_min_budget",
    "request_override",
    "server_config",
    "server_settings",
    "spelling",
]
