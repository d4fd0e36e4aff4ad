"""Azure OpenAI. The v1 API (`https://{resource}.openai.azure.com/openai/v1/`, `model`
naming the deployment) or the classic layout (`.../openai/deployments/{deployment}/
chat/completions?api-version=`, set `api_version`); the key in an `api-key` header;
429s say `retry-after-ms`; its quota counts the prompt estimate plus `max_tokens` when
the request arrives (its quota doc), and gives nothing back. Its first streamed chunk may
carry only `prompt_filter_results`, with empty `choices` (app/upstream/wire.py reads on)."""

from __future__ import annotations

from urllib.parse import quote

from app.upstream.deployments import Deployment
from app.upstream.providers.base import Provider


class Azure(Provider):
    name = "azure"

    def chat_url(self, deployment: Deployment, model: str) -> str:
        base = deployment.base_url.rstrip("/")
        if deployment.api_version is None:
            return base + "/chat/completions"
        root = base.removesuffix("/openai/v1").removesuffix("/openai")
        path = f"/openai/deployments/{quote(model, safe='')}/chat/completions"
        return f"{root}{path}?api-version={quote(deployment.api_version, safe='')}"

    def auth_headers(self, deployment: Deployment) -> dict[str, str]:
        return {"api-key": deployment.api_key} if deployment.api_key else {}
