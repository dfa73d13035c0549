"""A scheduled CHECK's place in a sandbox's order: it yields to any request."""

from __future__ import annotations

from cni_agent.sandboxes.order import Kind, Sequencer


def test_a_request_arriving_after_a_scheduled_check_makes_it_yield() -> None:
    order = Sequencer()
    with order.arrive("pod", Kind.BACKGROUND) as check:
        assert not check.superseded.is_set() and order.yielding("pod")
        with order.arrive("pod", Kind.REMOVE) as teardown:
            assert check.superseded.is_set() and not teardown.superseded.is_set()
    assert not order.yielding("pod")


def test_a_scheduled_check_arriving_behind_a_request_yields_at_once() -> None:
    order = Sequencer()
    with order.arrive("pod", Kind.ADD) as setup, order.arrive("pod", Kind.BACKGROUND) as check:
        assert check.superseded.is_set() and not setup.superseded.is_set()
    with order.arrive("other", Kind.BACKGROUND) as alone:
        assert not alone.superseded.is_set()  # another sandbox's requests do not count
