"""The webhook pieces that need no server: the signature, the declaration and its
address rule, the retry schedule setting."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError
from standardwebhooks import Webhook as Verifier

from app.settings import Settings, retry_delays
from lib.webhooks.signing import TenantSecrets, new_secret, sign
from lib.webhooks.spec import DEFAULT_EVENTS, Webhook, address_problems, decoded, encoded


@pytest.mark.timeout(5)
def test_a_signature_verifies_with_the_standardwebhooks_package() -> None:
    secret, body, stamp = new_secret(), b'{"id":4,"type":"execution:completed"}', int(time.time())
    headers = {
        "webhook-id": "ex_1.4",
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(secret, "ex_1.4", stamp, body),
    }
    assert Verifier(secret).verify(body, headers)["id"] == 4
    with pytest.raises(Exception, match=r"(?i)signature"):
        Verifier(new_secret()).verify(body, headers)


@pytest.mark.timeout(5)
def test_the_previous_secret_signs_only_until_its_end() -> None:
    secrets = TenantSecrets("whsec_new", "whsec_old", previous_until=1000.0)
    assert secrets.signing(now=999.0) == ["whsec_new", "whsec_old"]
    assert secrets.signing(now=1000.0) == ["whsec_new"]


@pytest.mark.timeout(5)
def test_a_webhook_defaults_to_the_ends_and_the_pause_and_refuses_what_it_cannot_send() -> None:
    hook = Webhook(url="https://hooks.example.com/x")
    assert tuple(hook.events) == DEFAULT_EVENTS
    assert decoded(encoded([hook])) == [hook]
    assert decoded("") == [] and encoded([]) == ""
    for bad in ({"url": "ftp://x.example/"}, {"url": "https://x.example", "events": ["nope"]},
                {"url": "https://x.example", "events": []}, {"url": "/relative"}):  # fmt: skip
        with pytest.raises(ValidationError):
            Webhook.model_validate(bad)


@pytest.mark.timeout(5)
def test_private_hosts_are_refused_unless_allowed() -> None:
    hooks = [
        Webhook(url=url)
        for url in (
            "https://hooks.example.com/x",  # a name: checked at delivery
            "http://127.0.0.1:9/x",
            "http://10.1.2.3/x",
            "http://[::1]/x",
            "http://localhost/x",
            "http://169.254.169.254/latest",
            "https://93.184.216.34/x",
        )
    ]
    problems = address_problems(hooks, "$.webhooks", allow_private=False)
    assert [p.path for p in problems] == [f"$.webhooks[{i}].url" for i in (1, 2, 3, 4, 5)]
    assert address_problems(hooks, "$.webhooks", allow_private=True) == []


@pytest.mark.timeout(5)
def test_loopback_written_in_the_legacy_numeric_forms_or_with_a_final_dot_is_refused() -> None:
    """What the resolver (inet_aton) reads as an address is one: 127.1, 2130706433,
    0x7f000001, 017700000001 and 0 are loopback or unspecified, localhost. is localhost."""
    urls = ("http://127.1/x", "http://2130706433/x", "http://0x7f000001/x",
            "http://017700000001/x", "http://0/x", "http://localhost./x",
            "http://a.localhost./x")  # fmt: skip
    hooks = [Webhook(url=url) for url in urls]
    problems = address_problems(hooks, "$.webhooks", allow_private=False)
    assert [p.path for p in problems] == [f"$.webhooks[{i}].url" for i in range(len(urls))]
    public = [Webhook(url="http://93.184.216.34/x"), Webhook(url="http://1e100.net/x")]
    assert address_problems(public, "$.webhooks", allow_private=False) == []


@pytest.mark.timeout(5)
def test_the_retry_schedule_setting() -> None:
    default = Settings.model_fields["webhook_retry_seconds"].default
    assert retry_delays(default) == [5, 300, 1800, 7200, 18000, 36000, 36000]
    assert retry_delays("0.5, 2") == [0.5, 2.0]
    assert retry_delays("") == []
    for bad in ("5,soon", "-1"):
        with pytest.raises(ValueError, match="FLOWCAST_WEBHOOK_RETRY_SECONDS"):
            retry_delays(bad)
