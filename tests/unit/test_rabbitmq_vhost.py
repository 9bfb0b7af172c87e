"""A private RabbitMQ vhost is only ever made on this machine's node, for an amqp:// URL."""

from __future__ import annotations

import pytest

from tasks_core.devkit.rabbitmq import PrivateVhost, RabbitMQError, is_amqp, masked


def test_the_vhost_url_keeps_the_user_and_server_and_names_a_fresh_vhost() -> None:
    one, two = PrivateVhost("amqp://me:secret@127.0.0.1:5672/", prefix="dtask_x"), PrivateVhost()
    assert one.name.startswith("dtask_x_") and one.name != two.name
    assert one.url == f"amqp://me:secret@127.0.0.1:5672/{one.name}"
    assert one.user == "me" and two.user == "guest"
    assert not one.created  # nothing is made before create()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:6379/0", "not a RabbitMQ URL"),
        ("amqp://guest:guest@10.1.2.3:5672/", "must name 127.0.0.1"),
    ],
)
def test_other_brokers_and_other_hosts_are_refused(url: str, message: str) -> None:
    with pytest.raises(RabbitMQError, match=message):
        PrivateVhost(url)


def test_amqp_schemes() -> None:
    assert is_amqp("amqp://h") and is_amqp("amqps://h") and is_amqp("pyamqp://h")
    assert not is_amqp("redis://h") and not is_amqp("rabbitmq")


def test_masked_hides_only_the_password() -> None:
    assert masked("amqp://me:secret@127.0.0.1:5672/v") == "amqp://me:***@127.0.0.1:5672/v"
    assert masked("redis://127.0.0.1:6379/11") == "redis://127.0.0.1:6379/11"
