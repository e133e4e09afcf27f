"""Model names the nodes can build, known on the login node without importing torch.

config validation (login node) checks train.model against these, so an unknown name fails in
one line at submit time instead of on every rank after the job waited in the queue.
train/models.py builds them; tests/unit/test_models.py checks both lists against the real builders
(BUILTIN and torchvision.models.list_models), so this copy cannot drift silently.
"""

from __future__ import annotations

import difflib
import re

BUILTIN_NAMES = ("cnn_tiny", "resnet8", "resnet20")
# torchvision.models.list_models(module=torchvision.models) of torchvision 0.29 (classification).
TORCHVISION_NAMES = (
    "alexnet", "convnext_base", "convnext_large", "convnext_small", "convnext_tiny",
    "densenet121", "densenet161", "densenet169", "densenet201", "efficientnet_b0",
    "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4", "efficientnet_b5",
    "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_l", "efficientnet_v2_m",
    "efficientnet_v2_s", "googlenet", "inception_v3", "maxvit_t", "mnasnet0_5", "mnasnet0_75",
    "mnasnet1_0", "mnasnet1_3", "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small",
    "regnet_x_16gf", "regnet_x_1_6gf", "regnet_x_32gf", "regnet_x_3_2gf", "regnet_x_400mf",
    "regnet_x_800mf", "regnet_x_8gf", "regnet_y_128gf", "regnet_y_16gf", "regnet_y_1_6gf",
    "regnet_y_32gf", "regnet_y_3_2gf", "regnet_y_400mf", "regnet_y_800mf", "regnet_y_8gf",
    "resnet101", "resnet152", "resnet18", "resnet34", "resnet50", "resnext101_32x8d",
    "resnext101_64x4d", "resnext50_32x4d", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0",
    "shufflenet_v2_x1_5", "shufflenet_v2_x2_0", "squeezenet1_0", "squeezenet1_1", "swin_b",
    "swin_s", "swin_t", "swin_v2_b", "swin_v2_s", "swin_v2_t", "vgg11", "vgg11_bn", "vgg13",
    "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "vit_b_16", "vit_b_32", "vit_h_14",
    "vit_l_16", "vit_l_32", "wide_resnet101_2", "wide_resnet50_2",
)
# A plugin builder: "package.module:function", imported on the nodes.
PLUGIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


def model_problem(name: str) -> str | None:
    """None if the nodes can build `name`, else a suggestion for the error's hint."""
    if name in BUILTIN_NAMES or name in TORCHVISION_NAMES or PLUGIN.fullmatch(name):
        return None
    close = difflib.get_close_matches(name, [*BUILTIN_NAMES, *TORCHVISION_NAMES], n=1)
    return (f"did you mean '{close[0]}'?" if close else
            f"use a built-in ({', '.join(BUILTIN_NAMES)}), a torchvision name such as resnet18, "
            "or \"package.module:function\" for your own builder")
