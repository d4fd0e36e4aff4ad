"""Each provider's differences, from the bodies and headers it really sends."""

from __future__ import annotations

from app.upstream.deployments import Deployment
from app.upstream.providers import PROVIDERS
from app.upstream.tokens import GEMINI_TILE_TOKENS


def azure(base_url: str, api_version: str | None = None) -> Deployment:
    return Deployment(
        "az", "azure", base_url, 1, 1, api_key_env="K", answer_model="m", api_key="k", api_version=api_version
    )


def test_each_limiter_counts_its_own_way() -> None:
    assert PROVIDERS["openai"].limiter_tokens(700, 500) == 1200
    assert PROVIDERS["azure"].limiter_tokens(700, 500) == 1200
    assert PROVIDERS["gemini"].limiter_tokens(700, 500) == 700
    # Nothing back from OpenAI's or Azure's; Gemini's counts the input it reports.
    assert PROVIDERS["openai"].limiter_settles(1200, 650, 40) == 1200
    assert PROVIDERS["azure"].limiter_settles(1200, 650, 40) == 1200
    assert PROVIDERS["gemini"].limiter_settles(700, 650, 40) == 650


def test_the_wait_is_where_each_provider_puts_it() -> None:
    assert (
        PROVIDERS["openai"].wait_hint({"retry-after-ms": "1500"}, PROVIDERS["openai"].error_info(None)) == 1.5
    )
    azure_body = {"error": {"code": "429", "message": "Please retry after 6 seconds."}}
    info = PROVIDERS["azure"].error_info(azure_body)
    assert info.code == "429" and PROVIDERS["azure"].wait_hint({"retry-after": "6"}, info) == 6.0
    google = [
        {
            "error": {
                "code": 429,
                "message": "Resource has been exhausted (e.g. check quota).",
                "status": "RESOURCE_EXHAUSTED",
                "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "17s"}],
            }
        }
    ]
    info = PROVIDERS["gemini"].error_info(google)
    assert info.code == "RESOURCE_EXHAUSTED" and PROVIDERS["gemini"].wait_hint({}, info) == 17.0
    assert PROVIDERS["gemini"].error_info({"error": "not an object"}).code is None


def test_a_429_says_which_limit_ran_out_where_the_provider_says_it() -> None:
    """A token 429 tells the learned charge it was too low; a request 429 says nothing of it."""
    openai = {"error": {"message": "Rate limit reached ... on tokens per min (TPM)", "type": "tokens"}}
    assert PROVIDERS["openai"].error_info(openai).limit == "tokens"
    assert PROVIDERS["openai"].error_info({"error": {"type": "requests"}}).limit == "requests"
    assert PROVIDERS["openai"].error_info({"error": {"type": "invalid_request_error"}}).limit is None

    def google(metric: str) -> list[dict[str, object]]:
        violation = {"quotaMetric": f"generativelanguage.googleapis.com/{metric}", "quotaValue": "1000"}
        details = [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [violation]}]
        return [{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": details}}]

    gemini = PROVIDERS["gemini"]
    assert gemini.error_info(google("generate_content_paid_tier_input_token_count")).limit == "tokens"
    assert gemini.error_info(google("generate_requests_per_model")).limit == "requests"
    assert gemini.error_info(google("something_else")).limit is None


def test_gemini_bills_an_image_by_768px_tiles() -> None:
    billing = PROVIDERS["gemini"].image_billing("gemini-2.5-flash")
    assert billing is not None
    assert billing.tokens(300, 200) == GEMINI_TILE_TOKENS
    assert billing.tokens(768, 576) == GEMINI_TILE_TOKENS
    assert billing.tokens(1536, 800) == 4 * GEMINI_TILE_TOKENS
    assert PROVIDERS["openai"].image_billing("gpt-4o-mini") is None  # the model profile's


def test_azure_urls_for_both_layouts() -> None:
    p = PROVIDERS["azure"]
    assert p.chat_url(azure("https://r.openai.azure.com/openai/v1"), "dep") == (
        "https://r.openai.azure.com/openai/v1/chat/completions"
    )
    classic = azure("https://r.openai.azure.com/", api_version="2024-10-21")
    assert p.chat_url(classic, "my dep") == (
        "https://r.openai.azure.com/openai/deployments/my%20dep/chat/completions?api-version=2024-10-21"
    )
    assert p.auth_headers(classic) == {"api-key": "k"}
