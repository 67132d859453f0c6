"""The default agents (GATEWAY_AGENT=gateway.demo:agent): an offline order-support desk.

"Support" checks order status with a tool and hands billing questions to "Billing", which can
open refunds and hands order questions back. Both run on ScriptedModel, so the whole product
works with no network and no API key. Orders 1001-1004 exist.
"""

from __future__ import annotations

from typing import Any

from gateway.agents import Agent, Rule, ScriptedModel, tool

ORDERS: dict[int, dict[str, str]] = {
    1001: {"status": "shipped", "detail": "it left our warehouse yesterday; tracking number TRK-55821."},
    1002: {"status": "processing", "detail": "it is being packed and should ship within one business day."},
    1003: {"status": "delivered", "detail": "it was delivered on Monday and signed for at the front door."},
    1004: {"status": "cancelled", "detail": "it was cancelled at your request and fully refunded."},
}

# Linear-time patterns (they run on the event loop, on whatever users send): no two adjacent parts may
# match the same spaces, and "after the first refund" is an atomic group, never retried at each later one.
ORDER_ID = r"(?:order|#|number|no\.?)(?:\s*(?:number|no\.?|#))?\s*(?P<order_id>\d{3,})"
AFTER_REFUND = r"^(?>.*?\b(?:refund|money back)\b).*?"
BARE_ORDER_ID = r"^\W*#?(?P<order_id>\d{3,})\W*$"


@tool
def check_order_status(order_id: int) -> dict[str, Any]:
    """Look up the status of an order.

    Args:
        order_id: The order number, e.g. 1001.
    """
    order = ORDERS.get(order_id)
    if order is None:
        return {
            "found": False,
            "summary": f"I couldn't find order {order_id}. Could you double-check the number?",
        }
    return {
        "found": True,
        "status": order["status"],
        "summary": f"Order {order_id} is {order['status']}: {order['detail']}",
    }


@tool
def request_refund(order_id: int, reason: str = "") -> dict[str, Any]:
    """Open a refund request for an order.

    Args:
        order_id: The order number to refund.
        reason: Why the customer wants the refund, if they said.
    """
    order = ORDERS.get(order_id)
    if order is None:
        return {"refund_id": None, "summary": f"I couldn't find order {order_id}, so no refund was opened."}
    if order["status"] == "cancelled":
        return {"refund_id": None, "summary": f"Order {order_id} was already cancelled and refunded in full."}
    refund_id = f"RF-{order_id}"
    return {
        "refund_id": refund_id,
        "summary": f"Refund {refund_id} is open for order {order_id}; "
        "the money is back on your card in 3-5 business days.",
    }


GREETING = r"^\W*(hi|hello|hey|good (morning|afternoon|evening))\b"
THANKS = r"\b(thanks|thank you|cheers|great|perfect)\b"
GOODBYE = r"\b(bye|goodbye|see you|that'?s all)\b"
BILLING_WORDS = r"\b(refund|money back|invoice|receipt|charge[ds]?|billing|payment|paid|overcharged)\b"

support_model = ScriptedModel(
    rules=[
        Rule(
            GREETING,
            reply="Hi! I'm the Acme support assistant. I can check an order's status (just send the order "
            "number, like 1001) or help with billing and refunds. What can I do for you?",
        ),
        Rule(BILLING_WORDS, handoff="Billing"),
        Rule(ORDER_ID, tool="check_order_status", reply="{result[summary]}"),
        Rule(BARE_ORDER_ID, tool="check_order_status", reply="{result[summary]}"),
        Rule(
            r"\b(where|track|status|deliver|shipping|shipped|arrive)\b",
            reply="Sure, I can check that. What's your order number? You'll find it in your confirmation "
            "email (for example 1001).",
        ),
        Rule(
            r"\b(human|person|agent|representative|someone)\b",
            reply="I'll pass this to our team: they answer Monday to Friday, 9:00-18:00, usually "
            "within a few hours. Meanwhile I can check orders and refunds right away.",
        ),
        Rule(r"\b(hours|open|opening)\b", reply="Our team is available Monday to Friday, 9:00-18:00 (CET)."),
        Rule(THANKS, reply="You're welcome! Anything else I can help with?"),
        Rule(GOODBYE, reply="Thanks for contacting Acme. Have a great day!"),
    ],
    fallback="I'm the Acme support assistant. I can check your order status (send me the order number) "
    "or help with billing and refunds. What would you like to do?",
)

billing_model = ScriptedModel(
    rules=[
        Rule(
            GREETING,
            reply="Hi! You're talking to Acme billing. How can I help with refunds, invoices or charges?",
        ),
        Rule(AFTER_REFUND + ORDER_ID, tool="request_refund", reply="{result[summary]}"),
        Rule(
            AFTER_REFUND + r"(?P<order_id>\d{3,})",
            tool="request_refund",
            reply="{result[summary]}",
        ),
        Rule(r"\b(refund|money back)\b", reply="I can open a refund for you. What's the order number?"),
        Rule(BARE_ORDER_ID, tool="request_refund", reply="{result[summary]}"),
        Rule(
            r"\b(invoice|receipt)\b",
            reply="Invoices are in your account under Orders > Invoices; I've also re-sent the latest one to "
            "your email.",
        ),
        Rule(
            r"\b(charge[ds]?|overcharged|payment|paid)\b",
            reply="Sorry about that! Charges can take up to 3 days to settle. If you were charged "
            "twice, send me the order number and I'll refund the duplicate.",
        ),
        Rule(r"\b(where|track|status|deliver|shipping|shipped|arrive)\b", handoff="Support"),
        Rule(THANKS, reply="Happy to help! Anything else about billing?"),
        Rule(GOODBYE, reply="Thanks for contacting Acme billing. Have a great day!"),
    ],
    fallback="I'm the billing assistant: I handle refunds, invoices and charges. For order tracking, just "
    "ask me where your order is.",
)

billing = Agent(
    name="Billing",
    instructions="You handle refunds, invoices and payment questions for Acme customers.",
    model=billing_model,
    tools=[request_refund],
)
agent = Agent(
    name="Support",
    instructions="You are Acme's friendly support assistant. Check order status with the tool; hand billing "
    "questions to Billing.",
    model=support_model,
    tools=[check_order_status],
    handoffs=[billing],
)
billing.handoffs.append(agent)
