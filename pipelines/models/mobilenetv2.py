"""MobileNetV2 (Sandler et al. 2018) with a width multiplier, for small images: the paper's
vision workload, defined here (there is no CPU torchvision to borrow from).

A model file as a user writes one (conf/model/mbv2.yaml: frontend torch): ``mobilenetv2(...)``
returns the module and an example batch of its inputs. ``blocks()`` lists the module paths of
its repeated blocks in order, so schemes can say "the last k blocks".
"""
from __future__ import annotations

import torch
from torch import nn


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round channel counts the way MobileNetV2 does (to a multiple of 8, never below 90%)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class ConvBNReLU6(nn.Sequential):
    """conv (no bias) -> batch norm -> ReLU6; ``groups == channels`` makes it depthwise."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=False),
        )


class InvertedResidual(nn.Module):
    """MobileNetV2 block: pointwise expand -> depthwise -> pointwise project (linear)."""

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(cin, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) with a width multiplier, for small images."""

    # expansion t, channels c, repeats n, first stride s
    SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, width: float = 0.35, num_classes: int = 10, in_channels: int = 3,
                 dropout: float = 0.0):
        super().__init__()
        cin = _make_divisible(32 * width)
        last = _make_divisible(1280 * max(1.0, width))
        features: list[nn.Module] = [ConvBNReLU6(in_channels, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(ConvBNReLU6(cin, last, kernel=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))

    def blocks(self) -> list[str]:
        """The inverted-residual blocks (features.1 .. features.N-2), input to output."""
        return [f"features.{i}" for i, m in enumerate(self.features)
                if isinstance(m, InvertedResidual)]


def mobilenetv2(batch_size: int, width: float = 0.35, num_classes: int = 10,
                in_channels: int = 3, image_size: int = 32):
    """The model and an example batch of its input."""
    model = MobileNetV2(width=width, num_classes=num_classes, in_channels=in_channels)
    return model, {"x": torch.zeros(batch_size, in_channels, image_size, image_size)}
