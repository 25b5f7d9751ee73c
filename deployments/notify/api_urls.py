from django.urls import path

from deployments.notify import api

urlpatterns = [
    path("notify/channels/", api.ChannelList.as_view(), name="api-notify-channels"),
    path("notify/channels/<id:pk>/", api.ChannelDetail.as_view(), name="api-notify-channel"),
    path("notify/channels/<id:pk>/test/", api.ChannelTest.as_view(), name="api-notify-channel-test"),
    path("notify/subscriptions/", api.SubscriptionList.as_view(), name="api-notify-subscriptions"),
    path("notify/subscriptions/<id:pk>/", api.SubscriptionDetail.as_view(), name="api-notify-subscription"),
    path("notify/quiet/", api.Quiet.as_view(), name="api-notify-quiet"),
    path("notify/slos/", api.SloList.as_view(), name="api-notify-slos"),
    path("notify/slos/<id:pk>/", api.SloDetail.as_view(), name="api-notify-slo"),
    path("notify/deliveries/", api.DeliveryList.as_view(), name="api-notify-deliveries"),
]
