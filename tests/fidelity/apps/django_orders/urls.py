from __future__ import annotations

from django.urls import path

from tests.fidelity.apps.django_orders import views

urlpatterns = [
    path("orders", views.create_order),
    path("orders/<str:key>", views.order, name="order"),
]
