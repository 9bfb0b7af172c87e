"""Request dependencies every api route shares, the domains' included: the caller (the Guard
authenticated it) and this process's services."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.auth import Principal, principal
from tasks_core.services import Services


async def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


Caller = Annotated[Principal, Depends(principal)]
Svc = Annotated[Services, Depends(services)]
