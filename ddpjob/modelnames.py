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
# Parameters of each, for estimates made without building the model (`ddpjob doctor`'s room for
# the in-memory snapshots): the built-ins as train/models.py builds them for 10 classes,
# torchvision's as its weights' metadata gives them (num_params: ImageNet's 1000-class head, so
# for fewer classes an upper bound). test_models checks both against torch.
PARAMS = {
    "cnn_tiny": 61338, "resnet8": 78042, "resnet20": 272474,
    "alexnet": 61100840, "convnext_base": 88591464, "convnext_large": 197767336,
    "convnext_small": 50223688, "convnext_tiny": 28589128, "densenet121": 7978856,
    "densenet161": 28681000, "densenet169": 14149480, "densenet201": 20013928,
    "efficientnet_b0": 5288548, "efficientnet_b1": 7794184, "efficientnet_b2": 9109994,
    "efficientnet_b3": 12233232, "efficientnet_b4": 19341616, "efficientnet_b5": 30389784,
    "efficientnet_b6": 43040704, "efficientnet_b7": 66347960, "efficientnet_v2_l": 118515272,
    "efficientnet_v2_m": 54139356, "efficientnet_v2_s": 21458488, "googlenet": 6624904,
    "inception_v3": 27161264, "maxvit_t": 30919624, "mnasnet0_5": 2218512, "mnasnet0_75": 3170208,
    "mnasnet1_0": 4383312, "mnasnet1_3": 6282256, "mobilenet_v2": 3504872,
    "mobilenet_v3_large": 5483032, "mobilenet_v3_small": 2542856, "regnet_x_16gf": 54278536,
    "regnet_x_1_6gf": 9190136, "regnet_x_32gf": 107811560, "regnet_x_3_2gf": 15296552,
    "regnet_x_400mf": 5495976, "regnet_x_800mf": 7259656, "regnet_x_8gf": 39572648,
    "regnet_y_128gf": 644812894, "regnet_y_16gf": 83590140, "regnet_y_1_6gf": 11202430,
    "regnet_y_32gf": 145046770, "regnet_y_3_2gf": 19436338, "regnet_y_400mf": 4344144,
    "regnet_y_800mf": 6432512, "regnet_y_8gf": 39381472, "resnet101": 44549160,
    "resnet152": 60192808, "resnet18": 11689512, "resnet34": 21797672, "resnet50": 25557032,
    "resnext101_32x8d": 88791336, "resnext101_64x4d": 83455272, "resnext50_32x4d": 25028904,
    "shufflenet_v2_x0_5": 1366792, "shufflenet_v2_x1_0": 2278604, "shufflenet_v2_x1_5": 3503624,
    "shufflenet_v2_x2_0": 7393996, "squeezenet1_0": 1248424, "squeezenet1_1": 1235496,
    "swin_b": 87768224, "swin_s": 49606258, "swin_t": 28288354, "swin_v2_b": 87930848,
    "swin_v2_s": 49737442, "swin_v2_t": 28351570, "vgg11": 132863336, "vgg11_bn": 132868840,
    "vgg13": 133047848, "vgg13_bn": 133053736, "vgg16": 138357544, "vgg16_bn": 138365992,
    "vgg19": 143667240, "vgg19_bn": 143678248, "vit_b_16": 86567656, "vit_b_32": 88224232,
    "vit_h_14": 633470440, "vit_l_16": 304326632, "vit_l_32": 306535400,
    "wide_resnet101_2": 126886696, "wide_resnet50_2": 68883240,
}
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
