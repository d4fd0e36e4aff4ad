"""Azure OpenAI. The v1 API (`https://{resource}.openai.azure.com/openai/v1/`, `model`
naming the deployment) or the classic layout (`.../openai/deployments/{deployment}/
chat/completions?api-version=`, set `api_version`); the key in an `api-key` header, or
(`auth` `entra_id`, for a resource whose keys are disabled) a Microsoft Entra ID token as
`Authorization: Bearer`, from azure-identity's `DefaultAzureCredential` (environment,
workload identity, managed identity, Azure CLI; `pip install ecoscan[azure]`);
429s say `retry-after-ms`; its quota counts the prompt estimate plus `max_tokens` when
the request arrives (its quota doc), and gives nothing back. Its first streamed chunk may
carry only `prompt_filter_results`, with empty `choices` (app/upstream/wire.py reads on)."""

from __future__ import annotations

from urllib.parse import quote

from app.upstream.credentials import Credential, RefreshingToken, Token
from app.upstream.providers import register
from app.upstream.providers.base import KEY, Deployment, Provider, installed

ENTRA_ID = "entra_id"
# What a token for Azure OpenAI (Azure AI services) is asked for.
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"


class Azure(Provider):
    name = "azure"
    auths = (KEY, ENTRA_ID)
    versioned = True

    def check(self, deployment: Deployment) -> str | None:
        if deployment.auth == ENTRA_ID and not installed("azure.identity"):
            return "auth: entra_id needs azure-identity (pip install 'ecoscan[azure]')"
        return super().check(deployment)

    def chat_url(self, deployment: Deployment, model: str) -> str:
        base = deployment.base_url.rstrip("/")
        if deployment.api_version is None:
            return base + "/chat/completions"
        root = base.removesuffix("/openai/v1").removesuffix("/openai")
        path = f"/openai/deployments/{quote(model, safe='')}/chat/completions"
        return f"{root}{path}?api-version={quote(deployment.api_version, safe='')}"

    def credential(self, deployment: Deployment) -> Credential:
        if deployment.auth != ENTRA_ID:
            return super().credential(deployment)
        from azure.identity.aio import DefaultAzureCredential

        source = DefaultAzureCredential()

        async def fetch() -> Token:
            info = await source.get_token_info(ENTRA_SCOPE)
            return Token(info.token, float(info.expires_on), info.refresh_on)

        return RefreshingToken(deployment.name, fetch, close=source.close)

    def auth_headers(self, deployment: Deployment) -> dict[str, str]:
        return {"api-key": deployment.api_key} if deployment.api_key else {}


register(Azure())
