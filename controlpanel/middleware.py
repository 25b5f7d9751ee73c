"""Every page needs a logged-in user, except the few listed here.

The API has its own authentication (session or token) through DRF's permission classes, so
`/api/` is left to DRF, which answers 401/403 as JSON instead of redirecting to the login page.
Works in both modes, so an ASGI request never hops to a thread just for this check.
"""
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.contrib.auth.views import redirect_to_login

PUBLIC_PREFIXES = ("/accounts/login/", "/static/", "/healthz", "/api/")


class LoginRequiredMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        if not request.path.startswith(PUBLIC_PREFIXES) and not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)

    async def _acall(self, request):
        if not request.path.startswith(PUBLIC_PREFIXES) and not (await request.auser()).is_authenticated:
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return await self.get_response(request)
