"""The sampling a model folder recommends: the parameters of its generation_config.json
that the OpenAI-compatible routes take where a request leaves them unset
(--sampling-defaults model, as SGLang's and vLLM's defaults read them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from radixserve.core.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)
# generation_config.json's names, which are the sampling parameters' own
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(folder: Path) -> dict[str, Any]:
    """Those of KEYS the folder's generation_config.json sets, each one the engine can
    honour (one it cannot is left out, with a warning, rather than failing every request
    that does not set it); {} without the file. Its top_k 0 (transformers': no top-k) is
    -1 here."""
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("%s is not read: %s", path, e)
        return {}
    if not isinstance(config, dict):
        logger.warning("%s is not read: not a JSON object", path)
        return {}
    defaults: dict[str, Any] = {}
    for key in KEYS:
        value = config.get(key)
        if value is None:
            continue
        if key == "top_k" and value == 0:
            value = -1
        try:
            SamplingParams.from_dict({key: value})
        except SamplingParamsError as e:
            logger.warning("%s: %s is not taken as a default (%s)", path, key, e)
            continue
        defaults[key] = value
    return defaults
