"""A worker holds a constrained request while its grammar compiles on a thread: plain
requests pass at once, held ones are handed on in arrival order once compiled, a compile
error comes back with its request, an aborted request is dropped."""

from __future__ import annotations

import threading

from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.engine.structured.grammar import GrammarError
from splitserve.services import messages as msg
from splitserve.services.workers.grammar_waits import GrammarWaits
from tests.support.wait import wait_for


def request(request_id: str, regex: str | None) -> msg.GenerateRequest:
    spec = StructuredOutputsParams(regex=regex) if regex is not None else None
    return msg.GenerateRequest(request_id, [1, 2], SamplingParams(structured_outputs=spec))


class Compiles:
    """A compile function that finishes a regex only when the test releases it."""

    def __init__(self) -> None:
        self.release = {name: threading.Event() for name in ("a", "b", "bad")}
        self.started: list[str] = []
        self.finished: list[str] = []

    def __call__(self, spec: StructuredOutputsParams) -> str:
        assert spec.regex is not None
        self.started.append(spec.regex)
        assert self.release[spec.regex].wait(10)
        self.finished.append(spec.regex)
        if spec.regex == "bad":
            raise GrammarError("invalid regex: bad")
        return spec.regex


def test_held_requests_are_handed_on_in_order_once_compiled() -> None:
    compiles = Compiles()
    waits = GrammarWaits(compiles)
    try:
        assert not waits.hold(request("plain", None))
        first, second = request("r1", "a"), request("r2", "b")
        assert waits.hold(first) and waits.hold(second)
        assert waits.held() == ["r1", "r2"]
        both = ["a", "b"]
        wait_for(lambda: sorted(compiles.started) == both, 10, message="both compiling")
        compiles.release["b"].set()
        wait_for(lambda: compiles.finished == ["b"], 10, message="r2's grammar compiled")
        assert waits.ready() == []  # r2 is compiled, but r1 came first
        compiles.release["a"].set()
        got: list[tuple[str, msg.Message, ValueError | None]] = []
        wait_for(lambda: got.extend(waits.ready()) or len(got) == 2, 10, message="both ready")
        assert got == [("r1", first, None), ("r2", second, None)]
        assert waits.held() == []
    finally:
        waits.close()


def test_a_compile_error_comes_back_with_its_request_and_an_abort_drops_one() -> None:
    compiles = Compiles()
    waits = GrammarWaits(compiles)
    try:
        bad, aborted = request("bad", "bad"), request("gone", "a")
        assert waits.hold(bad) and waits.hold(aborted)
        waits.discard(["gone"])
        assert waits.held() == ["bad"]
        compiles.release["bad"].set()
        compiles.release["a"].set()
        got: list[tuple[str, msg.Message, ValueError | None]] = []
        wait_for(lambda: got.extend(waits.ready()) or len(got) == 1, 10, message="bad ready")
        ((request_id, message, error),) = got
        assert (request_id, message) == ("bad", bad)
        assert isinstance(error, GrammarError) and str(error) == "invalid regex: bad"
        assert waits.ready() == [] and waits.held() == []
    finally:
        waits.close()
