"""The search's lookahead: evaluations made on a second thread while the owner solves,
handed to it unchanged, and a search's rows the same with it or without."""

import threading
import time
from contextlib import contextmanager

import pytest
from test_auto_search import CLUSTER, N, graph_of

import jscaler.search.milp as milp
from jscaler.search import search
from jscaler.search.lookahead import Lookahead, solving


def test_it_makes_the_upcoming_keys_only_while_the_owner_solves():
    threads = {}
    started = threading.Event()

    def make(key):
        threads[key] = threading.get_ident()
        started.set()
        if key == 3:
            raise ValueError("three")
        return key * 10

    with Lookahead(make, lambda: [1, 2, 3]) as ahead:
        time.sleep(0.2)
        assert not threads  # the owner is not solving: nothing is made
        with solving():
            assert started.wait(10)
            deadline = time.monotonic() + 10
            while len(threads) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # the interpreter is free, as HiGHS leaves it
        assert ahead.get(1) == 10 and ahead.get(2) == 20
        with pytest.raises(ValueError, match="three"):
            ahead.get(3)  # raised where the owner asks, not on the second thread
        assert ahead.get(4) == 40  # never upcoming: made by the owner
    assert ahead.made_ahead == 3
    owner = threading.get_ident()
    assert threads[4] == owner and all(threads[k] != owner for k in (1, 2, 3))


def test_a_key_asked_for_is_not_made_again_and_solving_alone_does_nothing():
    calls = []
    with solving():  # no lookahead: nothing to start
        pass
    with Lookahead(lambda k: calls.append(k) or k, lambda: [1, 2]) as ahead:
        assert ahead.get(1) == 1  # asked before any solve: the owner's
        with solving():
            deadline = time.monotonic() + 10
            while 2 not in calls and time.monotonic() < deadline:
                time.sleep(0.01)
        assert ahead.get(2) == 2
    assert sorted(calls) == [1, 2] and ahead.made_ahead == 1


def test_a_search_gets_the_same_rows_with_its_lookahead(monkeypatch):
    """Each solve held open a while, so the lookahead makes evaluations: the rows and the
    winner are those of the search made one evaluation at a time."""
    real = milp.solving

    @contextmanager
    def slow():
        with real():
            yield
            time.sleep(0.2)

    monkeypatch.setattr(milp, "solving", slow)
    graph = graph_of("gpt-tiny", 2)
    kw = dict(cluster=CLUSTER, microbatches=(2,), cache=False)
    ahead = search(graph, N, **kw)
    alone = search(graph, N, **kw, lookahead=False)
    assert ahead.made_ahead > 0 and alone.made_ahead == 0
    assert f"{ahead.made_ahead} made while an ILP solved" in ahead.explain()

    def figures(result):
        return [(r.label(), r.plan, r.step_time, r.memory, r.fits, r.note) for r in result.rows]

    assert figures(ahead) == figures(alone)
    assert ahead.plan.name == alone.plan.name
