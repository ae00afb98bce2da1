"""inspect_ai entry point (`[project.entry-points.inspect_ai]`): registers `capserve/<model>`.

The provider module is imported only when inspect asks for a capserve model, so listing
providers stays fast.
"""

from inspect_ai.model import modelapi


@modelapi(name="capserve")
def capserve() -> type:
    from provider.inspect_provider import CapserveAPI

    return CapserveAPI
