"""The flat turn's token budget (app/engine/hf/scheduler.py `compose`), with stand-in work: queue
order, what does not fit waits, one caller takes at most half a turn while others wait, and light and
heavy work each take at most half while the other waits."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.hf.scheduler import compose


@dataclass(eq=False)
class Stand:
    """Work that wants `want` tokens in pieces of `piece` (it takes whole pieces only)."""

    caller: int
    want: int
    piece: int = 1
    heavy: bool = False
    took: list[int] = field(default_factory=list)

    def ask(self, room: int) -> int:
        left = self.want - sum(self.took)
        tokens = min(left, room // self.piece * self.piece)
        if tokens:
            self.took.append(tokens)
        return tokens


def turn(queue, budget):
    return compose(queue, budget, lambda work, room: work.ask(room))


def test_work_is_taken_in_queue_order_until_the_budget_is_spent():
    a, b, c = Stand(1, 300), Stand(1, 500), Stand(1, 400)
    assert turn([a, b, c], 1000) == [a, b, c]
    assert (a.took, b.took, c.took) == ([300], [500], [200])  # c's rest waits for the next turn


def test_what_does_not_fit_waits_while_smaller_work_behind_it_goes():
    wide, small = Stand(1, 600, piece=600), Stand(1, 100)
    first = Stand(1, 500)
    assert turn([first, wide, small], 1000) == [first, small]
    assert wide.took == [] and small.took == [100]


def test_one_caller_takes_at_most_half_a_turn_while_another_waits_then_the_rest():
    heavy = Stand(1, 5000)
    steady = Stand(2, 40)
    assert turn([heavy, steady], 1000) == [heavy, steady]
    assert heavy.took == [500, 460] and steady.took == [40]  # the second walk fills what is left
    lone = Stand(3, 5000)
    assert turn([lone], 1000) == [lone] and lone.took == [1000]  # alone: the whole turn


def test_nothing_to_run_takes_no_part():
    done, busy = Stand(1, 0), Stand(2, 10)
    assert turn([done, busy], 100) == [busy]


def test_light_and_heavy_work_each_take_at_most_half_a_turn_while_the_other_waits():
    # One caller (a decision) with both kinds, so only the kinds' shares hold in the first walk.
    light = [Stand(1, 300), Stand(1, 300)]
    heavy = Stand(1, 5000, heavy=True)
    assert turn([*light, heavy], 1000) == [*light, heavy]
    assert [work.took for work in light] == [[300], [200]] and heavy.took == [500]
    alone = [Stand(1, 300), Stand(1, 300), Stand(1, 600)]
    assert turn(alone, 1000) == alone and alone[2].took == [400]  # one kind: no shares
