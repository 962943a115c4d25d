from __future__ import annotations

import datetime as dt
import enum
import inspect
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest

from celery_dlock import KeyTemplate, LockKeyError, validate_key
from celery_dlock.keys import MAX_KEY_BYTES, canonical


def charge(order_id: int, amount: Decimal = Decimal("0"), *, currency: str = "EUR") -> None:
    """The guarded function of most tests."""


@dataclass
class Order:
    id: int
    customer: dict[str, Any]


def handle(order: Order, payload: dict[str, Any]) -> None:
    pass


def flexible(kind: str, **extra: Any) -> None:
    pass


class Color(enum.Enum):
    RED = "red"
    NUMBER = 7


@pytest.mark.parametrize("source", ["order:{order_id}", "order:<order_id>"])
def test_both_template_forms_give_the_namespaced_key(source: str) -> None:
    template = KeyTemplate(source, charge)
    assert template.render((42,), {}) == "job:order:42"


def test_positional_and_keyword_calls_give_the_same_key() -> None:
    template = KeyTemplate("order:{order_id}:{currency}:{amount}", charge)
    keys = {
        template.render((42, Decimal("10.50")), {}),
        template.render((), {"order_id": 42, "amount": Decimal("10.5")}),
        template.render((42,), {"amount": Decimal("10.500"), "currency": "EUR"}),
    }
    assert keys == {"job:order:42:EUR:10.5"}


def invoice(customer: str, year: int, month: int = 1, draft: bool = False) -> None:
    """Only positional-or-keyword parameters: keys are mapped without Signature.bind."""


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("ada", 2026), {}),
        (("ada", 2026, 3), {}),
        (("ada",), {"year": 2026, "draft": True}),
        ((), {"month": 5, "year": 2026, "customer": "ada"}),
        (("ada", 2026, 3, False), {}),
    ],
)
def test_simple_signatures_map_calls_as_bind_does(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    template = KeyTemplate("inv:{customer}:{year}:{month}:{draft}", invoice)
    bound = inspect.signature(invoice).bind(*args, **kwargs)
    bound.apply_defaults()
    expected = "job:inv:{customer}:{year}:{month}:{draft}".format(**bound.arguments)
    assert template.render(args, kwargs) == expected.replace("True", "true").replace(
        "False", "false"
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [
        (("ada", 2026, 3, False, "extra"), {}, "too many positional arguments"),
        (("ada", 2026), {"year": 2027}, "multiple values for argument 'year'"),
        (("ada", 2026), {"colour": "red"}, "unexpected keyword argument 'colour'"),
        (("ada",), {}, "missing a required argument: 'year'"),
    ],
)
def test_simple_signatures_refuse_bad_calls_as_bind_does(
    args: tuple[Any, ...], kwargs: dict[str, Any], problem: str
) -> None:
    template = KeyTemplate("inv:{customer}:{year}", invoice)
    with pytest.raises(LockKeyError, match=problem):
        template.render(args, kwargs)


def test_defaults_are_applied() -> None:
    assert KeyTemplate("c:{currency}", charge).render((1,), {}) == "job:c:EUR"


def test_attribute_and_item_access() -> None:
    template = KeyTemplate("order:{order.id}:{payload[id]}:{order.customer[name]}", handle)
    order = Order(id=5, customer={"name": "ada"})
    assert template.render((order, {"id": "p-9"}), {}) == "job:order:5:p-9:ada"
    literal = KeyTemplate("order:<order.id>:<payload[id]>", handle)
    assert literal.render((order, {"id": 3}), {}) == "job:order:5:3"


def test_callable_gets_the_bound_arguments() -> None:
    seen: list[tuple[Any, ...]] = []

    def key(order_id: int, amount: Decimal, *, currency: str) -> str:
        seen.append((order_id, amount, currency))
        return f"pay:{order_id}"

    template = KeyTemplate(key, charge)
    assert template.render((), {"order_id": 1}) == "job:pay:1"
    assert seen == [(1, Decimal("0"), "EUR")]


def test_callable_returning_a_value_is_made_canonical() -> None:
    template = KeyTemplate(lambda order_id, amount, currency: order_id, charge)
    assert template.render((uuid.UUID(int=1),), {}) == f"job:{uuid.UUID(int=1)}"


def test_namespace_prefix_can_be_changed_or_dropped() -> None:
    assert KeyTemplate("o:{order_id}", charge, namespace="pay").render((1,), {}) == "pay:o:1"
    assert KeyTemplate("o:{order_id}", charge, namespace="").render((1,), {}) == "o:1"


def test_var_keyword_parameters_can_be_placeholders() -> None:
    template = KeyTemplate("{kind}:{region}", flexible)
    assert template.render(("sync",), {"region": "eu"}) == "job:sync:eu"


def test_format_spec_is_honoured() -> None:
    assert KeyTemplate("o:{order_id:05d}", charge).render((42,), {}) == "job:o:00042"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (42, "42"),
        (-7, "-7"),
        (True, "true"),
        (False, "false"),
        (None, "null"),
        ("a b", "a b"),
        (1.5, "1.5"),
        (Decimal("10.50"), "10.5"),
        (Decimal("100"), "100"),
        (Decimal("1E+2"), "100"),
        (Decimal("-0.00"), "0"),
        (uuid.UUID("12345678-1234-5678-1234-567812345678"), "12345678-1234-5678-1234-567812345678"),
        (dt.date(2026, 11, 21), "2026-11-21"),
        (dt.datetime(2026, 11, 21, 10, 30), "2026-11-21T10:30:00"),
        (
            dt.datetime(2026, 11, 21, 11, 30, tzinfo=dt.timezone(dt.timedelta(hours=1))),
            "2026-11-21T10:30:00Z",
        ),
        (dt.datetime(2026, 11, 21, 10, 30, tzinfo=dt.timezone.utc), "2026-11-21T10:30:00Z"),
        (Color.RED, "red"),
        (Color.NUMBER, "7"),
    ],
)
def test_canonical_text(value: Any, text: str) -> None:
    assert canonical(value) == text


def test_equal_values_give_equal_keys() -> None:
    assert canonical(Decimal("2.0")) == canonical(Decimal("2"))
    # A JSON client sends 42.0 where another sends 42: the same order, the same key.
    assert canonical(42.0) == canonical(42) == canonical(Decimal("42.00")) == "42"
    assert canonical(-0.0) == canonical(0) == "0"
    assert canonical(1e20) == canonical(10**20) == canonical(Decimal("1E+20"))
    assert canonical(1e-7) == canonical(Decimal("1E-7")) == "0.0000001"
    assert canonical(0.1) == canonical(Decimal("0.1")) == "0.1"  # the float's shortest text
    assert canonical(float("nan")) == canonical(Decimal("NaN")) == "NaN"
    assert canonical(float("-inf")) == canonical(Decimal("-Infinity")) == "-Infinity"
    paris = dt.timezone(dt.timedelta(hours=1))
    same_instant = dt.datetime(2026, 1, 1, 13, tzinfo=paris)
    assert canonical(same_instant) == canonical(dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc))


def test_a_value_without_canonical_text_is_refused() -> None:
    with pytest.raises(LockKeyError, match="no canonical key text for a value of type object"):
        canonical(object())
    template = KeyTemplate("o:{order_id}", charge)
    with pytest.raises(LockKeyError, match="Order"):
        template.render((Order(1, {}),), {})


def test_placeholder_that_is_not_a_parameter_names_task_and_placeholder() -> None:
    with pytest.raises(LockKeyError) as info:
        KeyTemplate("order:{order}", charge, owner="shop.tasks.charge")
    message = str(info.value)
    assert "'order'" in message and "shop.tasks.charge" in message
    assert "order_id" in message  # the parameters are listed


def test_literal_form_placeholder_is_checked_too() -> None:
    with pytest.raises(LockKeyError, match="'orderid'"):
        KeyTemplate("order:<orderid>", charge)


def test_positional_placeholders_are_refused() -> None:
    for source in ("order:{}", "order:{0}"):
        with pytest.raises(LockKeyError, match="positional placeholder"):
            KeyTemplate(source, charge)


def test_malformed_template_is_refused() -> None:
    with pytest.raises(LockKeyError, match="malformed"):
        KeyTemplate("order:{order_id", charge)


def test_template_of_wrong_type_is_refused() -> None:
    with pytest.raises(LockKeyError, match="must be a str template or a callable"):
        KeyTemplate(42, charge)  # type: ignore[arg-type]


def test_missing_argument_is_named() -> None:
    template = KeyTemplate("o:{order_id}", charge)
    with pytest.raises(LockKeyError, match="order_id"):
        template.render((), {})


def test_missing_item_or_attribute_is_named() -> None:
    template = KeyTemplate("p:{payload[id]}", handle)
    with pytest.raises(LockKeyError, match=r"\{payload\[id\]\}"):
        template.render((Order(1, {}), {}), {})
    template = KeyTemplate("p:{order.number}", handle)
    with pytest.raises(LockKeyError, match=r"\{order.number\}"):
        template.render((Order(1, {}), {}), {})


def test_empty_key_is_refused() -> None:
    with pytest.raises(LockKeyError, match="empty"):
        validate_key("")
    with pytest.raises(LockKeyError, match="empty"):
        KeyTemplate(lambda order_id, amount, currency: "", charge, namespace="").render((1,), {})


def test_key_over_1024_bytes_is_refused_and_1024_is_fine() -> None:
    assert validate_key("k" * MAX_KEY_BYTES)
    with pytest.raises(LockKeyError, match="1025 bytes"):
        validate_key("k" * (MAX_KEY_BYTES + 1))
    with pytest.raises(LockKeyError, match="bytes of UTF-8"):
        validate_key("é" * 513)  # 1026 bytes in 513 characters


@pytest.mark.parametrize("char", ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\u2028"])
def test_control_characters_are_refused(char: str) -> None:
    with pytest.raises(LockKeyError, match="control character"):
        validate_key(f"job:a{char}b")
    template = KeyTemplate("o:{order_id}", charge)
    with pytest.raises(LockKeyError, match="control character"):
        template.render((f"x{char}",), {})


def test_non_text_key_is_refused() -> None:
    with pytest.raises(LockKeyError, match="must be a str"):
        validate_key(42)  # type: ignore[arg-type]
    with pytest.raises(LockKeyError, match="not valid Unicode"):
        validate_key("job:\udcff")


def test_decimals_of_more_than_28_digits_keep_every_digit() -> None:
    """Two orders whose amounts differ in the 29th digit: normalize() rounded both to 28
    digits, one key, and ``once`` replayed the one's result for the other."""
    one, other = Decimal("12345678901234567890123456789"), Decimal("12345678901234567890123456788")
    assert canonical(one) == "12345678901234567890123456789"
    assert canonical(other) == "12345678901234567890123456788"
    assert canonical(Decimal("1234567890123456789012345678.90")) == (
        "1234567890123456789012345678.9"
    )


@pytest.mark.parametrize(
    "value",
    [Decimal("1E+10000000"), Decimal("1E-10000000"), 10**5000],
    ids=["1E+10000000", "1E-10000000", "int-of-5001-digits"],
)
def test_a_number_past_a_keys_length_is_a_lock_key_error(value: Any) -> None:
    """Not a ten-million-character string, a ``0`` (1E-10000000 normalized), nor a bare
    ValueError from an int past Python's 4300 digits."""
    with pytest.raises(LockKeyError, match=f"{MAX_KEY_BYTES} bytes"):
        canonical(value)
