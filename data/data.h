// data/data.h — data sets in host memory and a batch loader with one batch of prefetch: the data/
// headers a program needs, in one.
//
//   data/dataset.h    Dataset and Split: images as floats in [0,1], (N, C, H, W), and labels
//   data/readers.h    MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100 read from their files
//   data/synthetic.h  procedural synthetic images, the same bytes on every machine
//   data/spec.h       a data set named in one string ("cifar10:DIR") parsed into a value and loaded
//   data/loader.h     the batch loader: shuffled, augmented, normalised batches, one prefetched
//
// Beside them: data/formats.h and data/gzip.h (the file formats parsed from bytes in memory),
// data/folder.h (a folder of pictures as a data set), data/random.h (the portable randomness the
// loader and the synthetic images draw from: Note [Portable randomness]).
#pragma once
#include "data/dataset.h"
#include "data/loader.h"
#include "data/readers.h"
#include "data/spec.h"
#include "data/synthetic.h"
